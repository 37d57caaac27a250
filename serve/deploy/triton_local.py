"""A real Triton Inference Server on this machine, without docker or a GPU.

The ``nvidia-pytriton`` wheel bundles a ``tritonserver`` binary (2.51) with the Python backend only
(no ONNX Runtime, TensorRT or PyTorch backend), so it serves a repository written with
``ldlm triton-repo --graph-backend python``. Setting it up takes three things, done once by
:func:`prepare_env` under a cache folder (network needed that once):

1. the wheel, unpacked with ``pip install --no-deps --target``: it pins ``numpy<2`` and cannot be
   installed beside our NumPy 2, and we need none of its Python code, only its files;
2. the Python backend stub of the running Python copied to ``backends/python/triton_python_backend_stub``
   (the wheel ships one per Python, 3.8 to 3.13, as pytriton's own launcher does);
3. an environment for the stub in which NumPy 1.26 comes first: the stub predates NumPy 2, and with
   NumPy 2 every tensor reaches the model with 0 bytes (BYTES tensors arrive garbled). The stub's
   embedded Python runs isolated (``sys.flags.isolated``: PYTHONPATH is ignored) and takes its
   environment from the ``python3`` first on ``PATH``. So the stub gets a venv of its own
   (``stub-<hash>/``) whose ``.pth`` files put ``numpy1/`` (NumPy 1.26, installed once) before
   the running environment's site-packages, where ``ldlm``, ONNX Runtime and torch are.

The server then runs with ``LD_LIBRARY_PATH`` at the wheel's ``nvidia_pytriton.libs`` (the stub,
copied away from its RPATH, finds its libraries there), the stub venv's ``bin/`` first on ``PATH``
and every endpoint on 127.0.0.1. Without a GPU it logs CUDA warnings and serves on CPU.

    python -P -m ldlm.serve.deploy.triton_local prepare
    python -P -m ldlm.serve.deploy.triton_local serve runs/triton --http-port 8000
"""

from __future__ import annotations

import argparse
import signal
import sys

from ldlm.serve.deploy.triton_env import DEFAULT_CACHE, prepare_env
from ldlm.serve.deploy.triton_server import start_server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -P -m ldlm.serve.deploy.triton_local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help=f"where the environment is made (default: {DEFAULT_CACHE})")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="make the environment (network needed once) and print its folder")
    serve = sub.add_parser("serve", help="run tritonserver on 127.0.0.1 with REPO until Ctrl-C")
    serve.add_argument("repo", help="a repository from `ldlm triton-repo EXPORT OUT --graph-backend python --cpu`")
    for name, default in (("http", 8000), ("grpc", 8001), ("metrics", 8002)):
        serve.add_argument(f"--{name}-port", type=int, default=default, help=f"default: {default}")
    args = parser.parse_args(argv)
    env = prepare_env(args.cache)
    if args.command == "prepare":
        print(f"{env.root} (stub environment {env.stub_env})")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so `finally` stops the server on SIGTERM too
    server = start_server(args.repo, env, sys.stdout, args.http_port, args.grpc_port, args.metrics_port)
    print(f"tritonserver (pid {server.pid}) ready: http://{server.http_url}, grpc {server.grpc_url}", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print(f"tritonserver exited with {server.stop()}", flush=True)


if __name__ == "__main__":
    main()
