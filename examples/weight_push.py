"""RL weight push in one screen: a training process takes SGD steps on a tiny MLP and pushes
each new version straight into the inference process's tensors (fabric_lib.weights), which
serves every request with the last complete version (flip mode: two copies, no half-written
model). Run: /usr/bin/python3 examples/weight_push.py [tcp|shm] (PYTHONPATH=build/python)."""

import multiprocessing as mp
import shutil
import sys
import tempfile

import torch

import fabric_lib
import fabric_lib.weights as fw

STEPS, HIDDEN = 3, 64


def engine(provider):
    return fabric_lib.TransferEngine(fabric_lib.Config(provider=provider, nics=[
        {"tcp": "lo", "shm": "shm"}[provider]]))


def trainer(provider, directory, conn):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    push = fw.TrainerWeights(engine(provider), 0, 1, fabric_lib.FileRegistry(directory))
    for name, p in model.named_parameters():
        push.add(name, p.data)  # the live parameters: every step's values, no copy kept
    push.publish()
    push.connect(num_inference=1)
    for version in range(1, STEPS + 1):
        x = torch.randn(256, HIDDEN)
        loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()  # learn y = sum(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        conn.recv()  # the inference side has prepared `version`
        stats = push.push(version)
        print(f"trainer: step {version} loss {loss.item():.3f}, pushed {stats['bytes']} B "
              f"in {stats['total'] * 1e3:.1f} ms")


def main(provider):
    directory = tempfile.mkdtemp(prefix="weight-push-", dir="/dev/shm")
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=trainer, args=(provider, directory, child))
    proc.start()
    # The inference side: its own copy of the architecture, registered by name.
    served = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                 torch.nn.Linear(HIDDEN, 1))
    weights = fw.InferenceWeights(engine(provider), 0, fabric_lib.FileRegistry(directory))
    for name, p in served.named_parameters():
        weights.add(name, p.data)
    weights.publish()
    probe = torch.ones(1, HIDDEN)  # the right answer is 64
    for version in range(1, STEPS + 1):
        done = weights.prepare(version)  # requests keep using the current copy meanwhile
        parent.send(version)
        done.result(timeout=60)
        current = weights.tensors()  # the copy holding the version just completed
        for name, p in served.named_parameters():
            p.data = current[name]
        with torch.no_grad():
            out = served(probe)
        print(f"inference: serving version {weights.version}: f(1...1) = {out.item():.3f}")
    proc.join(30)
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tcp")
