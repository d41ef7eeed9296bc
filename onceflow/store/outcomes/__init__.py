"""What the runtime hands out and awaits an answer for: durable outcomes and their acknowledgement inbox
(coordinator-outcome-delivery.md), which runtime delivers them, and host calls that ended. Writer thread.
"""
