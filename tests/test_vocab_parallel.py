"""The embedding lookup and the head's cross-entropy split over the vocabulary
(``MaxText/layers/vocab_parallel.py``) equal the plain computation, forward and gradients, on 8
simulated devices: every batch axis in the vocabulary group, a subset of them (the vocabulary
does not divide by all), none, and in slices of the sequence. The reference here is written out:
``table[ids]`` and a log-softmax over whole logits on one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.config import load_config
from MaxText.layers.vocab_parallel import embed_lookup, head_nll_sum, vocab_group
from tests.conftest import make_config, scan_bodies

RULES = (("activation_batch", ("data", "fsdp", "expert")),)
B, S, D = 8, 16, 12


def reference_loss(table_VD, head_DV, x_BSD, ids_BS, weights_BS):
    h_BSD = x_BSD + table_VD[ids_BS]
    logprobs = jax.nn.log_softmax(jnp.einsum("bsd,dv->bsv", h_BSD, head_DV), axis=-1)
    return -(jnp.take_along_axis(logprobs, ids_BS[..., None], axis=-1)[..., 0] * weights_BS).sum()


def split_loss(chunks):
    def loss(table_VD, head_DV, x_BSD, ids_BS, weights_BS):
        h_BSD = x_BSD + embed_lookup(table_VD, ids_BS, jnp.float32, chunks, ("data", "fsdp", "expert"))
        return head_nll_sum(h_BSD, head_DV, ids_BS, weights_BS, chunks, ("data", "fsdp", "expert"))

    return loss


@pytest.mark.parametrize(
    "mesh_shape, vocab, chunks, group",
    [
        ((1, 2, 4), 64, 1, ("fsdp", "expert")),
        ((1, 2, 4), 64, 4, ("fsdp", "expert")),
        ((2, 2, 2), 36, 2, ("data", "fsdp")),  # 8 does not divide 36: the group is 4 of the 8
        ((1, 1, 8), 63, 1, ()),  # no batch axis divides 63: the plain computation
    ],
)
def test_split_over_the_vocabulary_equals_the_plain_computation(mesh_shape, vocab, chunks, group):
    keys = jax.random.split(jax.random.key(0), 5)
    args = (
        jax.random.normal(keys[0], (vocab, D)),
        0.3 * jax.random.normal(keys[1], (D, vocab)),
        jax.random.normal(keys[2], (B, S, D)),
        jax.random.randint(keys[3], (B, S), 0, vocab),
        (jax.random.uniform(keys[4], (B, S)) > 0.3).astype(jnp.float32),  # positions without loss
    )
    expected, expected_grads = jax.value_and_grad(reference_loss, argnums=(0, 1, 2))(*args)

    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "fsdp", "expert"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        assert vocab_group(vocab, ("data", "fsdp", "expert")) == group
        specs = (P(None, "fsdp"), P("fsdp", None), P(("data", "fsdp", "expert")), P(None), P(None))
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
        loss, grads = jax.jit(jax.value_and_grad(split_loss(chunks), argnums=(0, 1, 2)))(*placed)

    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))


def test_the_group_is_the_largest_product_of_batch_axes_dividing_the_vocabulary():
    """Given all three axes of 1,024 devices (data 8 x fsdp 2 x expert 64), 129,280 = 2^8 x 505
    rows split 128 ways (fsdp x expert, the axes the table's embed dim is stored over)."""
    mesh = jax.sharding.AbstractMesh((8, 2, 64), ("data", "fsdp", "expert"))
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(RULES):
        assert vocab_group(129_280, ("data", "fsdp", "expert")) == ("fsdp", "expert")
        assert vocab_group(129_280, ("data", "fsdp")) == ("data", "fsdp")


def test_auto_takes_the_axes_inside_the_fast_domain_on_gpu():
    """Tokens move over the group's axes, so on GPUs ``auto`` keeps the group inside a rack (no
    dcn factor: the GB200 recipe's racks split fsdp and data, leaving expert); CPU processes
    exchange over gloo and keep the plain computation."""
    config = load_config(["ici_expert_parallelism=4", "dcn_fsdp_parallelism=2"])
    assert config.with_platform("gpu").vocab_axes() == ("stage", "data", "expert", "tensor")
    assert config.with_platform("cpu").vocab_axes() == ()
    assert make_config("vocab_parallel_axes=[fsdp]").vocab_axes() == ("fsdp",)


def _depends_on(jaxpr, sources: set) -> set:
    """The variables of ``jaxpr`` computed from the equations whose primitive is in ``sources``."""
    tainted = set()
    for e in jaxpr.eqns:
        if e.primitive.name in sources or any(
            not isinstance(v, jax.extend.core.Literal) and v in tainted for v in e.invars
        ):
            tainted.update(e.outvars)
    return tainted


def test_the_heads_slices_gather_ahead_and_nothing_else_in_their_loops_is_a_collective():
    """In the split head's loops (forward and backward) a slice's GEMMs read tokens gathered in
    the iteration before, so each gather has the previous slice's GEMMs beside it. The loops hold
    no other collective but the backward's reduce-scatter of the token gradients: the softmax's
    statistics are combined over the group once, after the forward loop."""
    keys = jax.random.split(jax.random.key(1), 3)
    x_BSD, head_DV = jax.random.normal(keys[0], (B, S, D)), jax.random.normal(keys[1], (D, 64))
    ids_BS = jax.random.randint(keys[2], (B, S), 0, 64)
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 4), ("data", "fsdp", "expert"))

    def loss(x_BSD, head_DV):
        return head_nll_sum(x_BSD, head_DV, ids_BS, jnp.ones((B, S)), 4, ("data", "fsdp", "expert"))

    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x_BSD, head_DV).jaxpr
    bodies = [b for b in scan_bodies(jaxpr) if any(e.primitive.name == "dot_general" for e in b.eqns)]
    collectives = {"all_gather", "reduce_scatter", "psum", "pmax", "all_to_all", "ppermute", "psum_invariant"}
    found = [sorted(e.primitive.name for e in b.eqns if e.primitive.name in collectives) for b in bodies]
    assert found == [["all_gather"], ["all_gather", "reduce_scatter"]]  # the forward's loop, the backward's
    for body in bodies:
        gathered = _depends_on(body, {"all_gather"})
        dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
        assert not any(v in gathered for e in dots for v in e.invars if not isinstance(v, jax.extend.core.Literal))
