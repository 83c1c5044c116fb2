"""Writes mlp_fixed_weights.onnx: relu(x @ W) summed per sample, as mlp.onnx, but with W an
input of fixed shape [64, 16384] (weights the caller feeds) beside x [N, 64] with N free: a model
whose inputs do not all have a free dimension.

    python3 -m venv /tmp/onnx && /tmp/onnx/bin/pip install onnx && /tmp/onnx/bin/python make_mlp_fixed_weights.py
"""
import onnx
from onnx import TensorProto, helper

axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
graph = helper.make_graph(
    [
        helper.make_node("MatMul", ["x", "W"], ["hidden"], name="matmul"),
        helper.make_node("Relu", ["hidden"], ["active"]),
        helper.make_node("ReduceSum", ["active", "axes"], ["y"], keepdims=1),
    ],
    "mlp_fixed_weights",
    [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64]),
        helper.make_tensor_value_info("W", TensorProto.FLOAT, [64, 16384]),
    ],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
    initializer=[axes],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
onnx.checker.check_model(model)
onnx.save(model, __file__.replace("make_mlp_fixed_weights.py", "mlp_fixed_weights.onnx"))
