"""The engine, on the Trio thread: it plans what a command does and publishes what the store committed."""
