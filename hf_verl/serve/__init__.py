"""The rollout server (`hf-verl serve`)."""
