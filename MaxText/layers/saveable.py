"""The tensors the layers name for ``remat_policy: names`` (``remat_names`` picks among them),
defined once and without JAX, so that the config can check a run's names before JAX loads."""

# Each name, with the tensor it keeps per layer (``layers/remat.py`` ``saved``).
SAVEABLE: dict[str, str] = {
    "query_latent": "MLA's query down-projection (wq_a), before its norm: [tokens, q_lora_rank]",
    "key_value_latent": "MLA's key/value down-projection (wkv_a), before its norm: [tokens, kv_lora_rank + rope]",
    "query": "the queries from the up-projection (wq_b, or wq without a query latent): [tokens, heads, qk dims]",
    "key_value": "the keys and values from the up-projection (wkv_b): [tokens, heads, nope + v dims]",
    "attention": "the attention kernel's output [tokens, heads, v dims] and softmax statistics, what its "
    "backward reads besides its inputs (cudnn and flash; te and dot keep nothing and rerun)",
    "attention_out": "the attention's output projection (wo): [tokens, embed]",
    "router_logits": "the router's scores before the sigmoid: [tokens, experts]",
    "mlp_gate_up": "a dense MLP's or the shared experts' gate and up projections: 2 x [tokens, mlp]",
    "routed_gate_up": "the routed experts' gate and up grouped GEMMs: 2 x [routed rows, moe_mlp]",
}
