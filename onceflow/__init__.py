"""onceflow: an embeddable Trio runtime that dispatches workflow-step triggers exactly once."""
