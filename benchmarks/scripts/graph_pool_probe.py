"""Why dtkv.runtime._graphs takes a new pool handle once no graph holds the old one (one GPU, a few seconds).

A graph captured into a handle, destroyed while a tensor of its pool lives: the next capture into the same handle
fails torch's allocator assert (``use_count > 0``). Printed on an H200, torch 2.11.0+cu130 (2026-12-02):
``keep_out False ... ok`` and ``keep_out True ... RuntimeError it->second->use_count > 0 INTERNAL ASSERT FAILED``.

    python benchmarks/scripts/graph_pool_probe.py
"""

import torch


def main() -> None:
    handle = torch.cuda.graph_pool_handle()
    x = torch.ones(1 << 20, device="cuda")

    def capture():
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph, pool=handle):
            y = x * 2
        return graph, y

    for keep_out in (False, True):
        graph, y = capture()
        out = y if keep_out else None
        del graph, y
        try:
            graph, y = capture()
            print("keep_out", keep_out, "recapture into the same handle: ok")
            del graph, y
        except Exception as e:  # noqa: BLE001 - the probe prints what torch raises
            print("keep_out", keep_out, "recapture into the same handle:", type(e).__name__, str(e)[:160])
        del out


if __name__ == "__main__":
    main()
