"""The DeepSeek-V3 model: decoder layers, scanned stacks, multi-token prediction."""
