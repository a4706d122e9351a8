"""The machine a run is on: which dtypes it computes fast and at what rate (imports nothing of the project but
``lowmem.hardware`` itself).

- ``capability``: ``capability(device_type)``: a CPU's matrix-product rates measured once per machine and cached; a
  GPU's from ``gpu_peaks``. Asked by every dtype choice and by MFU.
- ``gpu_peaks``: a GPU's datasheet peaks and which 16-bit dtypes its compute capability runs fast.
"""
