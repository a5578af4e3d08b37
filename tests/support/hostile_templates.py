"""Chat templates a trusting server renders: the string builders of issue 28, shared by the
parsing tests (tests/unit/test_hostile_bodies.py) and the worker-process tests
(tests/integration/test_work_memory.py)."""

# Issue 28's templates: each built hundreds of MiB to gigabytes before a budget looked at it.
STRING_BUILDERS = {
    "join-of-a-range": "{{ range(99999)|join('x' * 99999) }}",  # 12.4 GB of RSS, 35 s
    "str-join": "{{ ('x' * 99999).join(range(99999)|map('string')) }}",
    "tilde-doubling": (  # 256 MiB, served 200
        "{% set ns = namespace(s='ab') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    ),
    "percent-width": "{{ '%536870912s' % 'x' }}",  # these three: 584 MiB, served 200
    "percent-star": "{{ '%*s' % (536870912, 'x') }}",
    "center-filter": "{{ 'x'|center(536870912) }}",
    "center-method": "{{ 'x'.center(536870912) }}",
    "format-filter": "{{ '%536870912s'|format('x') }}",
    "format-method": "{{ '{:>536870912}'.format('x') }}",
    "ljust": "{{ 'x'.ljust(536870912) }}",
    "replace-filter": "{{ ('x' * 99999)|replace('x', 'y' * 99999) }}",
    "replace-method": "{{ ('x' * 99999).replace('x', 'y' * 99999) }}",
    "indent": "{{ ('x\n' * 99999)|indent(99999) }}",
}
