"""Tasks an agent is trained on: one file each, chosen by name through `registry.TASKS`."""
