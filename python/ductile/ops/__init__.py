"""Optimizers for torch tensors on the host, stepped by ductile's C++
optimizer plugins; the layout mirrors ``deepspeed.ops`` (``ductile.ops.adam``
for ``deepspeed.ops.adam``)."""
