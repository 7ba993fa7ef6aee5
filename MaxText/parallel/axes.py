"""The names of the device-mesh axes, defined once.

The model never names these: it names logical axes (``embed``, ``exp``, ...), and
``logical_axis_rules`` in base.yml maps those onto the mesh axes here.
"""

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")
