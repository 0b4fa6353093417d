from agoq.bench.fixed_budget import main

main()
