"""Writes mlp.onnx: relu(x @ W) summed per sample, W = 0.001 everywhere (made by
ConstantOfShape, so the file holds no weights). x is [N, 64] float32 with N free; each sample
takes 64 KiB in each of the two [N, 16384] intermediates.

    python3 -m venv /tmp/onnx && /tmp/onnx/bin/pip install onnx && /tmp/onnx/bin/python make_mlp.py
"""
import onnx
from onnx import TensorProto, helper

shape = helper.make_tensor("shape", TensorProto.INT64, [2], [64, 16384])
value = helper.make_tensor("value", TensorProto.FLOAT, [1], [0.001])
axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
graph = helper.make_graph(
    [
        helper.make_node("ConstantOfShape", ["shape"], ["w"], value=value),
        helper.make_node("MatMul", ["x", "w"], ["hidden"], name="matmul"),
        helper.make_node("Relu", ["hidden"], ["active"]),
        helper.make_node("ReduceSum", ["active", "axes"], ["y"], keepdims=1),
    ],
    "mlp",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
    initializer=[shape, axes],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
onnx.checker.check_model(model)
onnx.save(model, __file__.replace("make_mlp.py", "mlp.onnx"))
