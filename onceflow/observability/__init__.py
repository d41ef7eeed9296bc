"""What a host sees of a running onceflow besides replies and events: structured logs (`logs`), metrics
(`metrics`) and traces (`tracing`), each through the host's own configuration (stdlib logging or structlog,
OpenTelemetry's API). Leaves: any layer may import them. Any thread.
"""
