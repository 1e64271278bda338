from longstraw.bench.cli import bench_app

bench_app()
