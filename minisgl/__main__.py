from minisgl.server.launch import main

main()
