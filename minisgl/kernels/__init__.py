"""Our own GPU kernels, in Triton. On a CPU they run in its interpreter (TRITON_INTERPRET=1)."""
