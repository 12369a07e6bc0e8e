import pytest
import torch
from models import MLP

import hetcc
from hetcc import verify
from hetcc.errors import AnalysisError
from hetcc.ir import annotate
from hetcc.passes.comm import CommEdge


def test_checks_are_on_in_tests():
    assert hetcc.config.check


def test_a_node_reading_from_a_later_stage_is_caught():
    gm = hetcc.analyze(MLP(), (torch.randn(3, 8),)).graph
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in compute:
        annotate(node, stage=0)
    annotate(compute[0], stage=1)  # fc1 on stage 1, its users on stage 0
    with pytest.raises(AnalysisError, match=r"reads %linear from later stage 1"):
        verify.check_stages(gm, hetcc.Plan((), 1.0, 1.0, 0.0, {}, 1, "1f1b", True))


def test_a_node_without_a_stage_is_caught():
    gm = hetcc.analyze(MLP(), (torch.randn(3, 8),)).graph
    with pytest.raises(AnalysisError, match="has no stage"):
        verify.check_stages(gm, hetcc.Plan((), 1.0, 1.0, 0.0, {}, 1, "1f1b", True))


def test_a_send_without_its_recv_is_caught():
    class Stage:
        def __init__(self, sends, recvs):
            self.sends, self.recvs = sends, recvs
            self.module = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())

    edge = CommEdge(7, 0, 1, "relu", (3, 16), torch.float32)
    verify.check_pipeline([Stage((edge,), ()), Stage((), (edge,))])
    with pytest.raises(AnalysisError, match="send tag 7 between stages 0 -> 1"):
        verify.check_pipeline([Stage((edge,), ()), Stage((), ())])


def test_graph_without_records_is_caught():
    gm = torch.fx.symbolic_trace(MLP())
    with pytest.raises(AnalysisError, match="has no hetcc record"):
        verify.check_graph(gm, after="test")
