"""onceflow's bundled examples: templates (*.yml), scenarios and the agent-host example (agent_host.py).
Pure: data and a runnable module, imported by nothing in the package."""
