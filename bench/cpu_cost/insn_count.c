/*
 * insn_count.c: a qemu TCG plugin that counts the guest instructions a program retires.
 *
 *   qemu-aarch64 -plugin ./libinsn_count.so,out=/tmp/n.txt prog ...
 *
 * At exit it writes "insns <total>\nvcpus <threads seen>\n" to `out` (stderr when no out= is given),
 * then one "mark <count>" line per marker the guest made, in order: the count retired up to that point.
 * A marker is close(MARK_FD) (MARK_FD: an fd no process has; the call fails with EBADF and has no other
 * effect): any guest language makes it, and one run splits into start-up, prefill and each decode step.
 * Every translated block gets an inline add of its instruction count, run each time the block runs: no
 * helper call, so the guest runs about as fast as without the plugin.
 *
 * No Debian binary package ships qemu-plugin.h, so the few declarations used are written out here, as
 * qemu 7.2's include/qemu/qemu-plugin.h has them (API version 1; checked against Debian's qemu 7.2 by
 * loading the plugin, which qemu refuses when the version is outside what it supports). A block that
 * exits early (a fault, a syscall that does not return) still counts whole: a rounding the counts carry.
 *
 * The inline add is not atomic: instructions that two guest threads retire at the same instant can lose
 * an increment. The programs counted here run their work on one thread; `vcpus` says how many threads
 * the guest started, so a reader sees when that was not so.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define QEMU_PLUGIN_EXPORT __attribute__((visibility("default")))

typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t; /* only passed through */
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_simple_cb_t)(qemu_plugin_id_t id, unsigned int vcpu_index);
typedef void (*qemu_plugin_vcpu_syscall_cb_t)(qemu_plugin_id_t id, unsigned int vcpu_index, int64_t num,
                                              uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5,
                                              uint64_t a6, uint64_t a7, uint64_t a8);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr,
                                              uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
void qemu_plugin_register_vcpu_init_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_simple_cb_t cb);
void qemu_plugin_register_vcpu_syscall_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_syscall_cb_t cb);

#ifndef INSN_COUNT_API_VERSION
#define INSN_COUNT_API_VERSION 1
#endif
QEMU_PLUGIN_EXPORT int qemu_plugin_version = INSN_COUNT_API_VERSION;

static uint64_t insns;
static unsigned int vcpus; /* the vcpu init callback runs under qemu's plugin lock: no race */
static char out_path[4096];

#define MARK_FD 0x51ee7u /* bench/cpu_cost/guest.py's MARK_FD */
#define SYS_CLOSE_X86_64 3
#define SYS_CLOSE_AARCH64 57 /* the generic syscall table's */
#define MAX_MARKS 4096
static uint64_t marks[MAX_MARKS];
static unsigned int n_marks;

static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &insns, qemu_plugin_tb_n_insns(tb));
}

static void vcpu_init(qemu_plugin_id_t id, unsigned int vcpu_index)
{
    (void)id;
    (void)vcpu_index;
    vcpus++;
}

static void on_syscall(qemu_plugin_id_t id, unsigned int vcpu_index, int64_t num, uint64_t a1, uint64_t a2,
                       uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6, uint64_t a7, uint64_t a8)
{
    (void)id, (void)vcpu_index, (void)a2, (void)a3, (void)a4, (void)a5, (void)a6, (void)a7, (void)a8;
    /* the block making the syscall has run its inline add already (it runs at the block's start) */
    if (a1 == MARK_FD && (num == SYS_CLOSE_X86_64 || num == SYS_CLOSE_AARCH64) && n_marks < MAX_MARKS) {
        marks[n_marks++] = insns;
    }
}

static void at_exit(qemu_plugin_id_t id, void *userdata)
{
    (void)id;
    (void)userdata;
    FILE *f = out_path[0] ? fopen(out_path, "w") : stderr;
    if (!f) {
        perror(out_path);
        return;
    }
    fprintf(f, "insns %" PRIu64 "\nvcpus %u\n", insns, vcpus);
    for (unsigned int i = 0; i < n_marks; i++) {
        fprintf(f, "mark %" PRIu64 "\n", marks[i]);
    }
    if (f != stderr) {
        fclose(f);
    }
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
    (void)info;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0) {
            snprintf(out_path, sizeof out_path, "%s", argv[i] + 4);
        } else {
            fprintf(stderr, "insn_count: unknown argument %s (expected out=PATH)\n", argv[i]);
            return -1;
        }
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, tb_trans);
    qemu_plugin_register_vcpu_init_cb(id, vcpu_init);
    qemu_plugin_register_vcpu_syscall_cb(id, on_syscall);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
