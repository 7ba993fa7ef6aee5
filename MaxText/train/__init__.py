"""Training: optimizer and schedule, train state, loss, the jitted step, metrics, the loop."""
