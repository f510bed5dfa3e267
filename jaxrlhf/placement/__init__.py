"""The JAX runtime of an execution plan: devices and meshes, logical-axis rules,
calls compiled per placement, reallocation and offload, and the executor that
runs any call graph on a plan."""
