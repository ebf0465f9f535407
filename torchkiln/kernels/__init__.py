"""Kernels torchkiln writes itself, where torch's own are measured slower on a path it serves. Each
file says why, with the measurement; each is built on first use and chosen by measurement."""
