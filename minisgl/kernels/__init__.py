"""Our own GPU kernels, in Triton; on a CPU they run in Triton's interpreter (TRITON_INTERPRET=1)."""
