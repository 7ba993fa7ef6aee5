"""MaxText-style JAX pretraining of DeepSeek-V3 with dropless mixture-of-experts."""
