"""The machine a run is on: which dtypes it computes fast and at what rate, the precision a run computes in, and
how much memory this process holds.

- ``capability``: ``Capability``, one device's matrix-product rates per dtype, and what they decide (fast or slow
  here, the dtype a narrow weight computes in, the peak MFU divides by, the start-up line).
- ``cpu_probe``: a CPU's rates, measured once per machine and cached.
- ``gpu_peaks``: a GPU's datasheet peaks and which 16-bit dtypes its compute capability runs fast.
- ``probe``: ``capability(device_type)``, this process's capability per device, asked by every dtype choice.
- ``precision``: ``--mixed_precision`` (float32, bf16, fp16 with its loss scaler), one class each.
- ``memory_use``: RSS and device memory probes, giving freed memory back, glibc's large-block threshold.
"""
