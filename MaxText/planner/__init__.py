"""The scale planner: a first-principles performance and memory model of MoE training at rack scale.

``tools/plan.py`` is the entry point. The package splits the model by job:

- ``systems``: the hardware table (peaks, HBM, NVLink domain, scale-out), one source per number;
- ``model``: what a model costs per token (FLOPs by GEMM class, parameters, activation sizes), read
  off the repository's own accounting for DeepSeek-V3 configs;
- ``layout``: a parallel layout (mesh axes split inside / across NVLink domains, pipeline, batch);
- ``constants``: every efficiency constant and software-stack option, each with the public figure
  it was calibrated on;
- ``memory``, ``compute``, ``comms``: memory per GPU, math time, collective volumes and times;
- ``estimate``: combines them into step time, TFLOPS/GPU, MFU, scaling efficiency;
- ``search``: enumerates the layouts the repository can run and ranks them;
- ``calibration``: the published results the constants are held to.
"""
