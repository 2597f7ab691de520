"""Kernels outside attention: other implementations of a formula of the model, each chosen by the platform the
step is traced for (jaxblock/attention/platform.py `target_platform`, as the attention dispatch chooses), each
recorded with its reason in run.json, each with a test against the plain formula. jaxblock/attention/ holds the
attention kernels."""
