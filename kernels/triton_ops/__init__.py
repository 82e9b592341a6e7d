"""Triton kernels of the model (GPU; on the CPU through `TRITON_INTERPRET=1` in tests).

Every kernel here keeps the batch invariance of `rlsys.kernels.reference` on its own terms:
the value computed for one row depends only on that row's inputs, through a reduction whose
order is fixed by absolute positions and constant tile shapes, never by the batch, the
number of sequences, the chunking of a prefill or where pages sit in the pool. Results are
not bitwise the plain-torch reference's (other summation orders); the reference is the
oracle within tolerance, and engine and trainer on one device run the same kernels.

Invariant: importing this package imports triton and torch only.
"""
