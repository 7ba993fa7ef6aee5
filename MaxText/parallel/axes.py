"""The names of the device-mesh axes, defined once.

The model never names these: it names logical axes (``embed``, ``exp``, ...), and
``logical_axis_rules`` in base.yml maps those onto the mesh axes here. ``stage`` is the pipeline's
axis (``parallel/pipeline.py``); it comes first, so that its dcn part is the outermost split of the
devices: stages across racks, the expert exchange inside one.
"""

STAGE_AXIS = "stage"
MESH_AXES: tuple[str, ...] = (STAGE_AXIS, "data", "fsdp", "expert", "tensor")

# The config keys ``ici_<name>_parallelism`` / ``dcn_<name>_parallelism`` of each axis.
_KEY_NAMES = {STAGE_AXIS: "pipeline"}


def parallelism_key(kind: str, axis: str) -> str:
    """The config key that sets ``axis``'s ways inside (``kind="ici"``) or across (``"dcn"``) fast domains."""
    return f"{kind}_{_KEY_NAMES.get(axis, axis)}_parallelism"
