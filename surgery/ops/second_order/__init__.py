"""Second-order compression: Hessians and the GPTQ/SparseGPT walk, stage by stage."""
