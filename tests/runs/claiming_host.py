"""A host process that claims runs over `onceflow serve` and then hangs (to be SIGKILLed): standard library
only, as a host in another language would be. `python -I claiming_host.py SOCKET AGENT COUNT LEASE` claims
COUNT runs of AGENT with a LEASE-second lease, prints each claim as one JSON line `{"id", "claim_token"}`
and then sleeps without renewing or finishing anything."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "facade"))
from wire_client import WireClient


def main(socket: str, agent: str, count: int, lease: float) -> None:
    client = WireClient(socket)
    for n in range(count):
        request = {"id": n, "type": "claim_run", "agent_profile_id": agent, "lease_seconds": lease}
        run = client.request(request)["reply"]["result"]
        print(json.dumps({"id": run["id"], "claim_token": run["claim_token"]}), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
