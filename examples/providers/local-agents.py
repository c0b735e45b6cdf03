#!/usr/bin/env python3
"""An exec provider for slotpool, as a starting point for your own (docs/providers.md).

Its "machines" are slotpool-agent processes on this host, one per backing node, each in
a directory of its own under STATE_DIR. A real provider calls a cloud's API where this
one starts and stops processes; what it must get right is the same:

- create is exactly once: run again with the same input (backing id and secret), it
  prints the machine the first run started instead of starting another;
- every machine records ("tags") the backing id it was created for, so that list
  reports it even when create's answer never reached the launcher;
- the secret and the bus credential go into files only the agent's user can read,
  never onto a command line;
- delete succeeds for a machine that is already gone;
- nothing but the JSON answer goes to stdout; messages go to stderr.

Usage, in pool.yaml:

    exec:
      create: [python3, examples/providers/local-agents.py, AGENT, STATE_DIR, create]
      delete: [python3, examples/providers/local-agents.py, AGENT, STATE_DIR, delete]
      list:   [python3, examples/providers/local-agents.py, AGENT, STATE_DIR, list]

AGENT is the slotpool-agent binary. Extra agent arguments may follow the operation.
"""
import hashlib
import json
import os
import signal
import subprocess
import sys

CONTRACT_VERSION = 2


def fail(message, code=1):
    print("local-agents.py: " + message, file=sys.stderr)
    sys.exit(code)


def read_request():
    req = json.load(sys.stdin)
    if req.get("v") != CONTRACT_VERSION:
        fail("request is contract version %r; this provider speaks %d" % (req.get("v"), CONTRACT_VERSION))
    return req


def private_file(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def alive(pid, agent):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return agent.encode() in f.read()
    except OSError:
        return False


def machines(state):
    """Every machine record under STATE_DIR."""
    out = []
    for name in sorted(os.listdir(state)):
        path = os.path.join(state, name, "machine.json")
        if os.path.exists(path):
            with open(path) as f:
                out.append(json.load(f))
    return out


def create(agent, state, extra):
    req = read_request()
    # One launch attempt = one backing id and secret: its machine's name.
    launch = hashlib.sha256((req["backing_id"] + "\0" + req["secret"]).encode()).hexdigest()[:16]
    work = os.path.join(state, "m-" + launch)
    record_path = os.path.join(work, "machine.json")
    if os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
        print(json.dumps({"id": record["id"], "host": record["host"], "data": record["data"]}))
        return
    os.makedirs(work, exist_ok=True)
    secret_file = os.path.join(work, "agent.secret")
    private_file(secret_file, req["secret"] + "\n")
    args = [agent, "--backing-id", req["backing_id"], "--slots", str(req["slots"]),
            "--nats", req["nats_url"], "--secret-file", secret_file,
            "--work-dir", os.path.join(work, "work"), *extra]
    if req.get("nats_credentials"):
        creds = os.path.join(work, "agent.creds")
        private_file(creds, req["nats_credentials"])
        args += ["--creds", creds]
    log = open(os.path.join(work, "agent.log"), "ab")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    record = {"id": "m-" + launch, "host": "127.0.0.1", "data": {"pid": proc.pid},
              "backing_id": req["backing_id"]}
    # Written last and atomically: a machine without its record is not listed, and is
    # stopped by its agent's failed heartbeats (the launcher deletes its backing node).
    tmp = record_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.rename(tmp, record_path)
    print(json.dumps({"id": record["id"], "host": record["host"], "data": record["data"],
                      "attributes": {"made-by": "local-agents.py"}}))


def delete(agent, state):
    req = read_request()
    work = os.path.join(state, os.path.basename(req["id"]))
    record_path = os.path.join(work, "machine.json")
    if not os.path.exists(record_path):
        return  # already gone
    with open(record_path) as f:
        record = json.load(f)
    pid = record["data"]["pid"]
    if alive(pid, agent):
        os.kill(pid, signal.SIGTERM)
    os.remove(record_path)


def main():
    if len(sys.argv) < 4:
        fail("usage: local-agents.py AGENT STATE_DIR create|delete|list [AGENT ARGS...]", 2)
    agent, state, op, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    os.makedirs(state, exist_ok=True)
    if op == "create":
        create(agent, state, extra)
    elif op == "delete":
        delete(agent, state)
    elif op == "list":
        sys.stdin.read()
        print(json.dumps([{k: m[k] for k in ("id", "host", "data", "backing_id")}
                          for m in machines(state)]))
    else:
        fail("unknown operation %r" % op, 2)


if __name__ == "__main__":
    main()
