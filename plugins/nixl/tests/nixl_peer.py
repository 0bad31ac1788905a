"""One NIXL agent with the FABRIC backend, made as vLLM's NixlConnector makes it
(nixl_agent(name, nixl_agent_config(backends=["FABRIC"]))), driven by JSON lines on stdin and
answering one JSON line on stdout per command. test_wheel.py runs two of them.

Its memory: one DRAM registration of three regions of `size` bytes: `inbox` (zeros: a peer
WRITEs into it), `outbox` (this agent's pattern: a peer READs it, and it is the source of this
agent's WRITEs) and `landing` (where this agent's READs land). Every answer that concerns bytes
carries their sha256, taken the moment the transfer or the notification was seen.

Commands: start, connect (a peer's metadata), xfer (WRITE to or READ from a peer, with a
notification), wait_notif, quit.
"""

import base64
import hashlib
import json
import os
import sys
import time

# Answers go to the stdout this process was given; everything else written there (NIXL's Python
# logger writes to stdout) goes to stderr.
ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

DEADLINE_S = 30.0


def digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


class Peer:
    def __init__(self, name, size):
        self.agent = nixl_agent(name, nixl_agent_config(backends=["FABRIC"]))
        self.size = size
        self.memory = torch.zeros((3, size), dtype=torch.uint8)
        g = torch.Generator().manual_seed(sum(name.encode()))
        self.memory[1] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        self.reg = self.agent.register_memory(self.memory)
        self.inbox, self.outbox, self.landing = self.memory[0], self.memory[1], self.memory[2]

    def start(self):
        return {
            "plugins": self.agent.get_plugin_list(),
            "backends": list(self.agent.backends),
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "inbox": self.inbox.data_ptr(),
            "outbox": self.outbox.data_ptr(),
            "outbox_sha256": digest(self.outbox),
        }

    def connect(self, metadata):
        name = self.agent.add_remote_agent(base64.b64decode(metadata))
        return {"peer": name.decode() if isinstance(name, bytes) else name}

    def xfer(self, op, peer, remote_addr, notif):
        local = self.outbox if op == "WRITE" else self.landing
        remote = self.agent.get_xfer_descs([(remote_addr, self.size, 0)], "DRAM")
        handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local), remote, peer,
                                            notif.encode())
        state = self.agent.transfer(handle)
        end = time.monotonic() + DEADLINE_S
        while state == "PROC" and time.monotonic() < end:
            state = self.agent.check_xfer_state(handle)
            time.sleep(0.001)
        backend = self.agent.query_xfer_backend(handle)
        self.agent.release_xfer_handle(handle)
        return {"state": state, "backend": backend, "local_sha256": digest(local)}

    def wait_notif(self, peer, notif):
        end = time.monotonic() + DEADLINE_S
        got = []
        while time.monotonic() < end:
            got += self.agent.get_new_notifs().get(peer, [])
            if notif.encode() in got:
                # The bytes the notification vouches for, as they are when it is seen.
                return {"notifs": [n.decode() for n in got], "inbox_sha256": digest(self.inbox),
                        "outbox_sha256": digest(self.outbox)}
            time.sleep(0.001)
        return {"notifs": [n.decode() for n in got], "timeout": True}

    def quit(self):
        self.agent.deregister_memory(self.reg)
        return {"bye": True}


def main():
    name, size = sys.argv[1], int(sys.argv[2])
    peer = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "start":
                peer = Peer(name, size)
                answer = peer.start()
            else:
                args = {k: v for k, v in cmd.items() if k != "cmd"}
                answer = getattr(peer, cmd["cmd"])(**args)
        except Exception as e:  # noqa: BLE001 - the test reports it
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), file=ANSWERS, flush=True)
        if cmd["cmd"] == "quit":
            break


if __name__ == "__main__":
    main()
