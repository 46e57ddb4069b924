"""Pure tensor functions of the RL algorithms: advantages, policy losses, KL, log-probs."""
