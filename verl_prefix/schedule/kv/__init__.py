"""The prefix's K/V between phases: the container phase A fills and phase B's leaves copy (``container``), the
contexts that capture and serve it inside attention (``contexts``), and the seam through which they reach HF's
attention (``seam``)."""
