"""frontend/rnn_kernels.without_cudnn: cuDNN off exactly around recurrent modules' forward, on a CUDA device only,
and restored however the forward ends."""
import pytest
import torch

from pstar_fx.frontend.rnn_kernels import without_cudnn


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(4, 4)
        self.rnn = torch.nn.GRU(4, 4, batch_first=True)
        self.seen = {}
        self.pre.register_forward_hook(lambda m, a, o: self.seen.__setitem__("linear", torch.backends.cudnn.enabled))
        self.rnn.register_forward_hook(lambda m, a, o: self.seen.__setitem__("gru", torch.backends.cudnn.enabled))

    def forward(self, x):
        return self.rnn(self.pre(x))[0].sum()


@pytest.fixture
def cudnn_on():
    was = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = True
    yield
    torch.backends.cudnn.enabled = was


def test_cudnn_is_off_only_inside_the_rnn_on_a_cuda_device(cudnn_on):
    net = _Net()
    x = torch.randn(2, 3, 4)
    with without_cudnn(net, torch.device("cuda")):
        net(x)
        assert torch.backends.cudnn.enabled
    assert net.seen == {"linear": True, "gru": False}
    assert torch.backends.cudnn.enabled
    assert not net.rnn._forward_pre_hooks and len(net.rnn._forward_hooks) == 1    # its own hook only


def test_nothing_changes_on_the_cpu(cudnn_on):
    net = _Net()
    with without_cudnn(net, torch.device("cpu")):
        net(torch.randn(2, 3, 4))
    assert net.seen == {"linear": True, "gru": True}


def test_a_forward_that_raises_restores_cudnn(cudnn_on):
    net = _Net()
    with pytest.raises(RuntimeError):
        with without_cudnn(net, torch.device("cuda")):
            net(torch.randn(2, 3, 5))           # the Linear takes 4 features: it raises before the GRU
    assert torch.backends.cudnn.enabled
    with without_cudnn(net, torch.device("cuda")):
        with pytest.raises(RuntimeError):
            net.rnn(torch.randn(2, 3, 7))       # the GRU itself raises, with cuDNN off
        assert torch.backends.cudnn.enabled     # its forward hook ran all the same
        net(torch.randn(2, 3, 4))
    assert net.seen == {"linear": True, "gru": False}
    assert torch.backends.cudnn.enabled
    assert not net.rnn._forward_pre_hooks
