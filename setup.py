"""Maps the top-level directories onto import names (metadata lives in pyproject.toml).

areal_grpc (core library) <- areal_grpc/, areal_servers <- servers/, areal_clients <- clients/,
arealgrpc.v1 (generated stubs) <- generated/python/arealgrpc/.
"""

from setuptools import find_packages, setup

ROOTS = {
    "areal_grpc": "areal_grpc",
    "areal_servers": "servers",
    "areal_clients": "clients",
    "arealgrpc": "generated/python/arealgrpc",
}

packages: list[str] = []
for name, directory in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(directory)]

# SGLang's CPU stand-ins are put on the launched SGLang's path, not imported here. Python sees
# their folders as packages, so they are listed as such: setuptools drops (and warns about)
# importable folders missing from `packages`.
STAND_INS = ["rollout/sglang_cpu/*.*", "rollout/sglang_cpu/sgl_kernel/*.py"]
packages += ["areal_servers.rollout.sglang_cpu", "areal_servers.rollout.sglang_cpu.sgl_kernel"]
setup(
    packages=packages,
    package_dir=ROOTS,
    package_data={"arealgrpc": ["**/*.pyi"], "areal_servers": STAND_INS},
)
