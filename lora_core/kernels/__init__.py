"""Framework-free GPU kernels (Triton), shared by `torch_lora` and `jax_lora`.

Nothing here imports torch or jax: `lora_triton` holds the kernels and the launch planning (grids,
meta-parameters, strides) as plain Python, `configs` the tuned launch configurations.
"""
