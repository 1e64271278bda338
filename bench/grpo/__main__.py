from bench.grpo.commands import bench_app

bench_app()
