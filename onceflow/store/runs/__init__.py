"""The runs queue: idempotent enqueue and its key format, claims with fencing tokens and leases, flow
control (ceilings, rates, pauses), open-run counts. Writer thread.
"""
