"""The rollout plane's core objects (no Ray): admission scheduling and its client, and the
agent loop: the scaffold, the tool-call parser, tools, compaction, tasks and verifiers,
demonstrations and scripted replay. Sandboxes are reached only through `rlsys.sandboxes`."""
