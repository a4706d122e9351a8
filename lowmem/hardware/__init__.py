"""The machine a run is on: which dtypes it computes fast and at what rate (imports nothing else of the project).

- ``capability``: ``Capability``, one device's matrix-product rates per dtype, and what they decide (fast or slow
  here, the dtype a narrow weight computes in, the peak MFU divides by, the start-up line).
- ``cpu_probe``: a CPU's rates, measured once per machine and cached.
- ``gpu_peaks``: a GPU's datasheet peaks and which 16-bit dtypes its compute capability runs fast.
- ``probe``: ``capability(device_type)``, this process's capability per device, asked by every dtype choice.
"""
