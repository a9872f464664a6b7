"""What a dockerd that the tests start changes on the host, and putting it back once it has stopped.

A dockerd started on a machine that had no engine running leaves, after it stops: its `docker0` bridge, its iptables
chains and rules (filter and nat), the FORWARD chain's policy set to DROP, and the sysctls it turned on (IPv4
forwarding, iptables on bridged traffic). The FORWARD policy alone cuts off anything the machine routed before.
`.ci/run` and the docker test's `engine` fixture save the host's state before they start a dockerd and restore it
after they stop it: every rule and chain that appeared is deleted, policies and sysctls get their old values, a bridge
that was not there is deleted. Rules a dockerd removed are not put back (none does); `restore` checks the host is as
saved and names what is not.

Standard library only: `.ci/run` runs it with the system python3 before the virtual environment exists.

    python3 tests/e2e/dockerd_host.py save STATE.json
    python3 tests/e2e/dockerd_host.py restore STATE.json
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

BRIDGE = "docker0"
SYSCTLS = ("net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables")
BUILTIN_POLICY = "ACCEPT"  # what a built-in chain of a table that did not exist yet stands for


def _empty_table() -> dict:
    return {"policies": {}, "chains": set(), "rules": Counter()}


def _sysctl_wanted(old: str | None) -> str:
    """The value a sysctl goes back to: its old one, or 0 for a key that was absent (br_netfilter loaded by dockerd:
    0 is what its absence meant)."""
    return old if old is not None else "0"


def parse_iptables_save(text: str) -> dict[str, dict]:
    """iptables-save's output -> {table: {"policies": {built-in chain: policy}, "chains": {user chain, ...},
    "rules": Counter of "-A CHAIN ..." lines}} (the packet counters dropped)."""
    tables: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("*"):
            cur = tables.setdefault(line[1:], _empty_table())
        elif cur is None or not line or line.startswith("#") or line == "COMMIT":
            continue
        elif line.startswith(":"):
            name, policy = line[1:].split()[:2]
            if policy == "-":
                cur["chains"].add(name)
            else:
                cur["policies"][name] = policy
        elif line.startswith("-A "):
            cur["rules"][line] += 1
    return tables


def undo_commands(before: str, after: str) -> list[list[str]]:
    """The iptables commands that take the tables of `after` back to `before` (two iptables-save texts): delete the
    rules that appeared (last first), then the chains that appeared (empty by then), then set changed policies back."""
    b, a = parse_iptables_save(before), parse_iptables_save(after)
    cmds: list[list[str]] = []
    for table, now in a.items():
        was = b.get(table) or _empty_table()
        added = now["rules"] - was["rules"]
        for line in reversed([r for r in now["rules"] if r in added for _ in range(added[r])]):
            cmds.append(["iptables", "-t", table, "-D", *shlex.split(line)[1:]])
        for chain in sorted(now["chains"] - was["chains"]):
            cmds.append(["iptables", "-t", table, "-X", chain])
        for chain, policy in sorted(now["policies"].items()):
            old = was["policies"].get(chain, BUILTIN_POLICY)
            if policy != old:
                cmds.append(["iptables", "-t", table, "-P", chain, old])
    return cmds


def _normal(text: str) -> dict[str, tuple]:
    """A table's content for comparing two saves: a table with nothing in it equals no table."""
    out = {}
    for table, t in parse_iptables_save(text).items():
        policies = {c: p for c, p in t["policies"].items() if p != BUILTIN_POLICY}
        if policies or t["chains"] or t["rules"]:
            out[table] = (policies, sorted(t["chains"]), sorted(t["rules"].elements()))
    return out


def _iptables_save() -> str | None:
    """None where there are no iptables to read (not installed, or the kernel's tables cannot be read): then dockerd
    could not have set up its rules either, and there is nothing of them to undo."""
    if shutil.which("iptables-save") is None:
        return None
    r = subprocess.run(["iptables-save"], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def _sysctl(key: str) -> str | None:
    try:
        return Path("/proc/sys", key).read_text().strip()
    except OSError:          # br_netfilter not loaded: the key is not there
        return None


def snapshot() -> dict:
    return {"bridge": Path("/sys/class/net", BRIDGE).exists(), "iptables": _iptables_save(),
            "sysctl": {k: _sysctl(k) for k in SYSCTLS}}


def differences(before: dict, now: dict) -> list[str]:
    out = []
    if now["bridge"] and not before["bridge"]:
        out.append(f"network interface {BRIDGE}")
    if before["iptables"] is not None and now["iptables"] is not None:
        b, n = _normal(before["iptables"]), _normal(now["iptables"])
        out += [f"iptables table {t}: {n.get(t)} (was {b.get(t)})" for t in sorted(set(b) | set(n)) if b.get(t) != n.get(t)]
    for key, old in before["sysctl"].items():
        new = now["sysctl"].get(key)
        if new is not None and new != _sysctl_wanted(old):
            out.append(f"sysctl {key} = {new} (was {old if old is not None else 'absent'})")
    return out


def restore(before: dict) -> list[str]:
    """Undo what appeared since `before` (dockerd stopped already); returns what was undone. Raises RuntimeError
    naming whatever still differs afterwards."""
    done = []
    if not before["bridge"] and Path("/sys/class/net", BRIDGE).exists():
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, text=True, check=True)
        done.append(f"deleted {BRIDGE}")
    after = _iptables_save()
    if before["iptables"] is not None and after is not None:
        for cmd in undo_commands(before["iptables"], after):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
            done.append(" ".join(cmd[1:]))
    for key, old in before["sysctl"].items():
        new, want = _sysctl(key), _sysctl_wanted(old)
        if new is not None and new != want:
            Path("/proc/sys", key).write_text(want + "\n")
            done.append(f"sysctl {key} = {want}")
    left = differences(before, snapshot())
    if left:
        raise RuntimeError("the host still differs from before dockerd started: " + "; ".join(left))
    return done


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("save", "restore"):
        print("usage: dockerd_host.py save|restore STATE.json", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if argv[0] == "save":
        path.write_text(json.dumps(snapshot()))
        return 0
    try:
        done = restore(json.loads(path.read_text()))
    except (OSError, ValueError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"dockerd_host.py: {e}", file=sys.stderr)
        return 1
    print(f"dockerd_host.py: host restored, {len(done)} change(s) undone")
    for change in done:
        print(f"  {change}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
