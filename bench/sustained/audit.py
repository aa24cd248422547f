"""The offline check: a Python audit hook (PEP 578) that records every socket bind, connect, sendto and
getaddrinfo with its address, and the summary that lists any that is not loopback."""

from __future__ import annotations

import ipaddress
import sys
from typing import Any


def install_socket_audit(record: Any) -> None:
    """Record socket activity: `bind|connect|sendto|getaddrinfo <host> <port>` lines (PEP 578 events)."""

    def hook(event: str, args: tuple) -> None:
        if event in ("socket.bind", "socket.connect", "socket.sendto"):
            address = args[1] if event != "socket.sendto" else args[-1]
            if isinstance(address, tuple) and address:
                record(f"{event.split('.')[1]} {address[0]} {address[1] if len(address) > 1 else ''}")
            else:
                record(f"{event.split('.')[1]} unix {address!r}")
        elif event == "socket.getaddrinfo":
            record(f"getaddrinfo {args[0]} {args[1]}")

    sys.addaudithook(hook)


def is_loopback(host: str) -> bool:
    if host in ("localhost", "unix", "", "None"):
        return True
    if isinstance(host, bytes):
        host = host.decode()
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback or str(host) in ("0.0.0.0", "::")
    except ValueError:
        return False


def summarize_audit(lines: list[str]) -> dict[str, Any]:
    events = [line.split(" ", 2) for line in lines if line.strip()]
    outside = [" ".join(e) for e in events if len(e) > 1 and not is_loopback(e[1])]
    return {
        "socket_events": len(events),
        "kinds": sorted({e[0] for e in events}),
        "non_loopback": outside[:20],
        "offline_ok": not outside,
    }
