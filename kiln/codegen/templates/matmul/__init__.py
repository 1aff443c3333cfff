"""The matmul template (mm / bmm / addmm, and GEMV for few rows) and its config spaces."""
