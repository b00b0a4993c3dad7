"""The census of spec_plugins.host_reads counts what would wait for a GPU, on the CPU."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_venv.sh builds .venv)")

from spec_plugins.host_reads import HostReadCensus  # noqa: E402

DEV = torch.device("cpu")  # stands for the runner's device


def test_reads_of_device_tensors_count_and_host_tensors_do_not():
    device_tensor = torch.arange(4.0)  # made before the census: a device tensor (a model output, a cache)
    with HostReadCensus() as census:
        host = torch.tensor([1, 2, 3])
        host.tolist(), int(host[0]), bool(host.sum() > 0)  # host: free
        device_tensor.tolist()
        device_tensor.sum().item()
        bool(device_tensor.sum() > 0)
        device_tensor[device_tensor > 1]  # boolean-mask indexing sizes its output from device data
        device_tensor.nonzero()
        device_tensor.cpu().tolist()  # the .cpu() counts, the host copy's tolist does not
        int(device_tensor[0])
    reads = census.counts.reads
    assert sum(reads.values()) == 7, dict(reads)
    assert census.counts.total("blocking_uploads") == 0


def test_uploads_count_when_blocking_and_moved_tensors_are_device_tensors():
    with HostReadCensus() as census:
        host = torch.tensor([1, 2, 3])
        blocking = host.to(DEV)
        quiet = host.to(DEV, non_blocking=True)
        torch.tensor([1, 2], device=DEV)  # a blocking copy from pageable memory
        blocking.tolist(), quiet.tolist()  # both now live on the device
        node = torch.arange(3, device=host.device)  # ``.device`` of a host tensor names the host
        bool((node >= 1).any())
    assert census.counts.total("blocking_uploads") == 2
    assert census.counts.total("reads") == 2


def test_owner_is_the_innermost_caller_outside_torch():
    from spec_plugins import synthetic_trees  # any module of ours calling a read would count as ours

    with HostReadCensus() as census:
        torch.arange(3.0).tolist()  # this test file is not ours: the engine's
    assert census.counts.total("reads", "engine") == 1 and census.counts.total("reads", "ours") == 0
    assert synthetic_trees is not None


def test_device_tensors_answer_is_cpu_false_to_our_code_only():
    from spec_tree_kernels import reference

    first_child = torch.tensor([[1, -1]]).to(DEV)
    with HostReadCensus() as census:
        alive = torch.ones(1, dtype=torch.bool, device=DEV)
        sibling = torch.full((1, 2), -1, device=DEV)
        # the reference walk's early exit reads the device: not taken for device tensors
        reference._first_accepted_child(first_child[:, 0], alive, sibling, lambda child, k, scanning: scanning)
    assert census.counts.total("reads", "ours") == 0, dict(census.counts.sites)


def test_boolean_mask_writes_count_too():
    device_tensor = torch.zeros(4)
    with HostReadCensus() as census:
        device_tensor[device_tensor >= 0] = 1.0  # the mask's true count sizes the write: a read
    assert census.counts.total("reads") == 1
