#!/usr/bin/env python
"""The least a grpcio server adds to a KServe v2 infer call: ServerLive, and ModelInfer that runs the graph on
the event loop itself (an ONNX Runtime session opened as `ldlm serve` opens it), with no batcher, no checks,
no statistics, no log. kserve_round_trip.py measures it beside `ldlm serve`, as the floor of any Python front
end on the same machine: what `ldlm serve` adds above it is its own work, what it adds below is grpcio's.

    .venv/bin/python scripts/research/grpcio_floor.py EXPORT_DIR PORT
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ldlm.serve.api.kserve import kserve_datatype
from ldlm.serve.runtime.backends import open_graphs
from ldlm.serve.runtime.graph_backend import GraphBackend

DTYPES = {"FP32": np.float32, "INT64": np.int64}


class FloorServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, graphs: dict[str, GraphBackend]) -> None:
        self.graphs = graphs

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        feed = {
            tensor.name: np.frombuffer(raw, DTYPES[tensor.datatype]).reshape(tensor.shape)
            for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True)
        }
        outputs = self.graphs[request.model_name].run(feed)
        response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version="1")
        for name, array in outputs.items():
            response.outputs.add(name=name, datatype=kserve_datatype(array.dtype), shape=array.shape)
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
        return response


async def serve(export: str, port: int) -> None:
    graphs, _, _ = open_graphs("ort", export)
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(FloorServicer(graphs), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", help="an `ldlm export` directory")
    parser.add_argument("port", type=int, help="the port to serve gRPC on, on 127.0.0.1")
    args = parser.parse_args()
    asyncio.run(serve(args.export, args.port))


if __name__ == "__main__":
    main()
