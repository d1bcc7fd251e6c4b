"""What ``OffloadModel`` (``offload/model.py``) hands off, one job a file: where it computes and how
``.to()`` moves that (``placement.py``), the ``nn.Module`` reads that wait for pending host
updates first (``settled.py``), its copies and pickles (``copying.py``), and its call under
``torch.compile`` and ``torch.export`` (``compiled.py``). Nothing here is public: users reach it through ``OffloadModel``."""
