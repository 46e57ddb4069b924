"""The rollout batch and prompt-dataset preparation."""
