"""``contrail serve-env``: the command-line face of `EnvServer`."""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys

from contrail.envs.agentgym.protocol import DIALECTS
from contrail.envs.base import EnvOptionError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``serve-env`` to the ``contrail`` command's subparsers."""
    parser = sub.add_parser("serve-env", help="serve an environment over AgentGym's HTTP protocol")
    parser.add_argument("env", help="environment name, e.g. babyai (or pkg.module:Class)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: a free one, printed)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback; anything else exposes the server to the network)")
    parser.add_argument("--dialect", choices=sorted(DIALECTS), default=None,
                        help="AgentGym server whose wire format to speak (default: the env's own, else generic)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="environment option, VALUE read as JSON when it parses (repeatable)")
    parser.add_argument("--max-sessions", type=int, default=1024)
    parser.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session is closed")
    parser.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes")
    parser.set_defaults(handler=run)


def parse_options(pairs: list[str]) -> dict:
    """``["max_turns=5", "data_dir=/x"]`` -> ``{"max_turns": 5, "data_dir": "/x"}``."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise EnvOptionError(f"--option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value  # a bare string (a path, a name)
    return options


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    from contrail.envs.agentgym.server import EnvServer

    server = EnvServer(
        args.env, env_options=parse_options(args.option), dialect_name=args.dialect, host=args.host,
        port=args.port, max_sessions=args.max_sessions, idle_timeout=args.idle_timeout, max_body=args.max_body,
    )
    if not _is_loopback(args.host):
        print(f"warning: serving on {args.host}: anyone who reaches this address can play", file=sys.stderr)
    print(f"serving {args.env} ({server.dialect.name} dialect) on {server.url}", flush=True)
    server.serve_forever()
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
