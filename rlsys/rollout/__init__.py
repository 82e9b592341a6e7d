"""The rollout plane's core objects (no Ray): admission scheduling and its client loop."""
