"""Start SMG (`smg` 1.13 from PyPI) in front of prefixserve replicas, with the keys that replicas
requiring API keys need and none of them on a command line (docs/gateway.md, "SMG in front of keyed
replicas"; bench/cluster.sh and bench/cluster_bench.py start the gateway through this):

    python bench/smg_gateway.py [--api-keys-file FILE --gateway-key-file FILE] -- <smg launch flags>

With a keys file, SMG gets `--api-key <gateway key>` (the key it reads each replica's /v1/models with;
the replicas hold it as tenant `smg-gateway`) and `--tenant-api-key TENANT:KEY` for every key in the
file, read as the replicas read it (`prefixserve.server.operator.auth`), so each tenant's key passes SMG and
reaches the replica unchanged. SMG runs in this process (`smg.cli.main`), so the keys sit in its
memory, not in /proc/<pid>/cmdline where every local user could read them. Without a keys file it is
`smg launch <flags>` (open replicas register without a key).

    python bench/smg_gateway.py --check --api-keys-file FILE

only reads the file (exit status 2 and the reason when it holds no key, a bad line, or the tenant
name `smg-gateway`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefixserve.server.operator.auth import parse_key_spec, read_keys_file

GATEWAY_TENANT = "smg-gateway"  # the replicas' tenant for the gateway's probes; no keys file may name it


def tenant_keys(path: str) -> list[tuple[str, str]]:
    """(tenant, key) for every key in a replicas' keys file, the tenant as SMG may spell it: SMG splits
    `TENANT:KEY` at the first colon, so a colon in a tenant name (allowed here) becomes `_` (SMG's
    tenant id is only its own label; the replica still resolves the tenant from the key). Raises
    ValueError for a file the replicas would refuse, or one naming GATEWAY_TENANT."""
    pairs = [parse_key_spec(spec) for spec in read_keys_file(path)]
    if any(tenant == GATEWAY_TENANT for tenant, _ in pairs):
        raise ValueError(f"{path}: the tenant name {GATEWAY_TENANT!r} is the gateway's own; rename that tenant")
    return [(tenant.replace(":", "_"), key) for tenant, key in pairs]


def smg_argv(smg_flags: list[str], keys: list[tuple[str, str]], gateway_key: str | None) -> list[str]:
    """`smg launch` arguments: the flags given, then the key flags (none when `gateway_key` is None)."""
    argv = ["launch", *smg_flags]
    if gateway_key is not None:
        argv += ["--api-key", gateway_key]
        for tenant, key in keys:
            argv += ["--tenant-api-key", f"{tenant}:{key}"]
    return argv


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    ours, smg_flags = (args_in[: args_in.index("--")], args_in[args_in.index("--") + 1 :]) if "--" in args_in \
        else (args_in, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api-keys-file", help="the replicas' keys file (one 'KEY' or 'TENANT KEY' a line)")
    ap.add_argument("--gateway-key-file", help="file holding the gateway's key (the replicas' smg-gateway tenant)")
    ap.add_argument("--check", action="store_true", help="only read the keys file")
    args = ap.parse_args(ours)
    try:
        keys = tenant_keys(args.api_keys_file) if args.api_keys_file else []
    except (OSError, ValueError) as e:
        print(f"--api-keys-file: {e}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    gateway_key = None
    if args.api_keys_file:
        if not args.gateway_key_file:
            print("--api-keys-file needs --gateway-key-file", file=sys.stderr)
            return 2
        gateway_key = Path(args.gateway_key_file).read_text().strip()
    from smg.cli import main as smg_main  # the gateway itself, in this process

    smg_main(smg_argv(smg_flags, keys, gateway_key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
